"""OpenAI-compatible request and response bodies (chat and text completions), by concept:
`sampling` (the fields both requests share), `chat`, `completion`, `responses`.

The request schemas hold the fields tierserve honours and nothing else (extra
fields are forbidden): serving/http/request_fields.py classifies every field a
client may send and refuses, before these models see the body, whatever is not
honoured.
"""
