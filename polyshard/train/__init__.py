"""Training runs as the CLI starts them: a config checked before launch, then the loop on every rank."""
