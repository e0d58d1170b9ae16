"""The OpenAI-compatible HTTP server of one instance (`pdserve serve`)."""
