"""The engine: THE round loop, local training of a client, client batching and faults, N-process simulation."""
