"""Data: loading, prompt formatting, tokenization with loss masks, partitioning.

Typical use (the server does this)::

    data = build_federated_data(recipe.data, recipe.federation.partition,
                                recipe.federation.num_clients, tokenizer,
                                recipe.train.max_length, recipe.seed, task)
    batch = collate(data.client_examples(0)[:4], tokenizer.pad_token_id, task)  # fedllm.data.collate.collate

(``fedllm.data.collate`` is the module: import the function from it, which also keeps torch out of
``import fedllm.data``.)
"""

from fedllm.data.errors import DataError, PartitionError
from fedllm.data.federated import FederatedData, build_federated_data, partition_to_disk
from fedllm.data.formats import FORMATS, encode_records, make_encoder, resolve_label_names
from fedllm.data.loading import load_records
from fedllm.data.manifest import load_manifest, manifest_clients, partition_manifest, save_manifest
from fedllm.data.partition import partition_records
from fedllm.data.templates import INSTRUCTION_TEMPLATES, format_prompt, format_response, record_field
from fedllm.data.tokens import IGNORE_INDEX

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "INSTRUCTION_TEMPLATES",
    "DataError",
    "FederatedData",
    "PartitionError",
    "build_federated_data",
    "encode_records",
    "format_prompt",
    "format_response",
    "load_manifest",
    "load_records",
    "make_encoder",
    "manifest_clients",
    "partition_manifest",
    "partition_records",
    "partition_to_disk",
    "record_field",
    "resolve_label_names",
    "save_manifest",
]
