"""The one error a user sees for bad input: which field, and what is allowed."""


class InvalidPreset(ValueError):
    """Bad experiment input, found before any work starts."""

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")
