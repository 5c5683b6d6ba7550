"""OpenAI Batch API: jobs stored on disk, their lines run through the ingress at
the batch tier, resumed after a kill."""
