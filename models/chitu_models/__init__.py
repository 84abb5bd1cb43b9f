"""chitu-models: model architectures for chitu-core, one file per family, built from chitu_core.layers."""
