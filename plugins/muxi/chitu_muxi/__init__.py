"""chitu-muxi: the MetaX (Muxi) GPU backend."""
