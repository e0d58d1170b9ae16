"""The OpenAI API's wire types, shared by the API server (entrypoints/openai/) and the P/D
proxy (proxy/): request bodies (the fields pdserve honours) and their SamplingParams, the error
body, tool calls.

Unknown fields are ignored, as OpenAI's clients send some this server has no use for, and the
log names them (vLLM's warning); a known field of the wrong type (strictly: no coercion) or out
of range is a 400 that names it. So is a field of OpenAI's API or vLLM's that pdserve does not
implement yet, when the request turns it on: answering without it would look like success
(prose for a JSON schema, no tool call for a named tool).
"""
