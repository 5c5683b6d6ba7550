"""tierserve's application layer: config models, OpenAI schemas and the Serve app builder."""
