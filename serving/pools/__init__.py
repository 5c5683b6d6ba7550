"""Engine pools: the pool deployment around an engine process, its load monitor,
the calls into it, replica choice (Serve's request router) and autoscaling."""
