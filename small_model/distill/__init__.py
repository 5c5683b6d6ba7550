"""Knowledge distillation of a small student from the default model (`tierserve distill`).

The small pool and the interactive pool's draft model need a model of the same
tokenizer, and none can be downloaded here: the project makes it. A student is
the teacher cut to a few of its layers, then trained on the teacher's own
answers and soft targets, in bounded time on a CPU.
"""
