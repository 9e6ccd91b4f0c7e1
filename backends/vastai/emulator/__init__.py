"""An API-compatible vast.ai emulator over real HTTP on loopback: the HTTP server, the endpoints, its world of offers
and instances, and how instances run.
"""
