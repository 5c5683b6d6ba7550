"""The `tierserve` command: batch jobs, distillation, router training."""
