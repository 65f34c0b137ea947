"""CheckpointError: the one error type of every bad checkpoint (config, weights, index, tokenizer, generation
config), named after the file and the rule it breaks."""
from __future__ import annotations

import blockdiff.model
from blockdiff.model import CheckpointError


def test_checkpoint_error_is_a_public_value_error_of_the_model_package():
    assert issubclass(CheckpointError, ValueError)
    assert "CheckpointError" in blockdiff.model.__all__
    from blockdiff.integration.demo import CheckpointError as demo_error  # the CLI's old import path

    assert demo_error is CheckpointError
