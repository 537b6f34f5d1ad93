"""What a run keeps on disk: JSONL records read back past a torn line, storage faults named by
their path, and manifests that verify a directory's files."""
