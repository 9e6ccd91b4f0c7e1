"""iroh transport: QUIC between authenticated endpoints; the session machinery and version-guarded binding fixes beside
it.
"""
