"""The one exception type of the data pipeline."""


class DataError(ValueError):
    """Bad or unusable training data: a missing path, an empty corpus, a corrupt token file, a
    sequence length longer than the corpus, ... The message names the offending values."""
