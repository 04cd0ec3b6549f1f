"""Examples for lightning_speedkit (installed as ``speedkit_examples``)."""
