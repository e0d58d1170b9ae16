"""NixlConnector: decode workers pull prefill workers' KV blocks (vLLM's NixlConnector, pull mode)."""
