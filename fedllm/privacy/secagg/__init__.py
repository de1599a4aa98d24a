"""SecAgg+ secure aggregation (Bell et al., CCS 2020, "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead"): the server learns only the sum of the surviving clients' (quantised, weighted) uploads.

One concern per module, every stage a pure step on serialisable messages (:mod:`.messages`) so that the same
code runs between simulated clients in one process, across torch.distributed processes and as message exchanges
between fedllm's Flower ServerApp and its node workers (:mod:`fedllm.flower.secagg_stages`):

- :mod:`.params`: the protocol's public parameters (threshold, neighbours, quantisation, modulus, dropouts);
- :mod:`.quantize`: stochastic, unbiased quantisation of floats to integers and back, with its error bound;
- :mod:`.masks`: uniform integers modulo ``2^mod_bits`` expanded from a 256-bit seed by ChaCha20;
- :mod:`.crypto`: X25519 key agreement, HKDF, ChaCha20-Poly1305 and Shamir sharing (pycryptodome);
- :mod:`.graph`: the neighbour graph (a random Harary graph from a public round seed);
- :mod:`.client` / :mod:`.server`: the stages on each side — key advertisement, encrypted share exchange,
  masked input collection, the consistency check of the survivor list (Bonawitz et al., CCS 2017, §4), unmasking;
- :mod:`.rounds`: one whole run of the stages among in-process clients (tests, benchmarks);
- :mod:`.identity`: a client's public keys and its survivor list signed with its node key and verified against the
  registered ones (Flower deployments: :mod:`fedllm.flower.secagg_stages`; simulated keys in simulation).
"""

from fedllm.privacy.secagg.client import SecAggClient
from fedllm.privacy.secagg.messages import (
    EncryptedShare,
    KeyAdvert,
    MaskedInput,
    ShareReveal,
    SurvivorSignature,
    UnmaskRequest,
)
from fedllm.privacy.secagg.params import SecAggError, SecAggParams
from fedllm.privacy.secagg.server import SecAggServer

__all__ = [
    "EncryptedShare",
    "KeyAdvert",
    "MaskedInput",
    "SecAggClient",
    "SecAggError",
    "SecAggParams",
    "SecAggServer",
    "ShareReveal",
    "SurvivorSignature",
    "UnmaskRequest",
]
