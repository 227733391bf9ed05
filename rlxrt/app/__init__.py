"""rlxrt.app: the application layer — the CLI, bench, demo, the export entry point and the lookup of the
shipped assets. The only part of rlxrt that may import every other layer (core, backends, sessions,
exporters); each command imports what it needs inside its own function, so ``rlxrt --help`` stays light."""
