"""vast.ai: the provider, its REST client, offer choice, and an API-compatible emulator for CI."""
