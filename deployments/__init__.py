"""Ray Serve deployments: the OpenAI ingress and the engine pools, thin glue over engine/."""
