"""chitu-hygon: the Hygon DCU backend."""
