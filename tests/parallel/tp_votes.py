"""Scripted worker-side votes for the failure test (imported by the worker process)."""


class ExplodingVote:
    """A worker-side vote that raises at `layer`: the worker must report an error, never a cut.
    Lives in a module with no imports because the worker unpickles it: the test puts this
    directory on the workers' PYTHONPATH."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def __call__(self, step_id: int, layer: int) -> bool:
        if layer == self.layer:
            raise RuntimeError(f"worker exploded at layer {layer}")
        return False
