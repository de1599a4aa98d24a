"""The ground floor: errors, logging, redaction, the thread policy, lazy imports, registries, tracking, moved paths."""
