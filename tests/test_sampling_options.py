"""Sampling options that were silently ignored: presence and frequency penalties are honoured (as
llama.cpp, and so Ollama, applies them), and every option pebbling does not implement is refused
naming it, unless it is given its neutral value."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import tiny_model
from pyplugin.errors import OptionsError
from pyplugin.runtime import Generation
from pyplugin.runtime.options import Options
from pyplugin.runtime.sampling import Sampler, apply_presence_frequency

PROMPT = [5, 17, 42, 8, 99, 3]


def test_penalties_subtract_presence_and_count_times_frequency():
    logits = np.array([2.0, 1.0, 0.5, 3.0], np.float32)
    got = apply_presence_frequency(logits, [3, 3, 1, 3], presence=0.5, frequency=0.25)
    np.testing.assert_allclose(got, [2.0, 1.0 - 0.25 - 0.5, 0.5, 3.0 - 3 * 0.25 - 0.5])


def test_a_frequency_penalty_turns_greedy_away_from_a_repeated_token():
    logits = np.array([1.0, 2.0, 1.9], np.float32)
    plain = Sampler(Options(temperature=0, repeat_penalty=1.0))
    penalized = Sampler(Options(temperature=0, repeat_penalty=1.0, frequency_penalty=0.2))
    assert plain(logits, [1, 1]) == 1 and penalized(logits, [1, 1]) == 2


@pytest.mark.parametrize("option", [{"presence_penalty": 1.5}, {"frequency_penalty": 1.0}])
def test_penalties_change_what_a_model_generates(option):
    model = tiny_model("llama", n_layer=1)
    base = dict(temperature=0, repeat_penalty=1.0, num_predict=24, num_ctx=64)
    plain = list(Generation(model, Options(**base)).tokens(PROMPT))
    penalized = list(Generation(model, Options(**base, **option)).tokens(PROMPT))
    assert plain != penalized
    assert len(set(penalized)) >= len(set(plain))  # fewer repeats, not more


@pytest.mark.parametrize("option,needle", [
    ({"typical_p": 0.5}, "'typical_p': 0.5 is not implemented by pebbling; leave it out or give it 1.0"), ({"tfs_z": 0.9}, "'tfs_z'"), ({"penalize_newline": True}, "false"),
    ({"temprature": 0.5}, "'temprature' is not an option pebbling knows"),
    ({"frequency_penalty": 3}, "'frequency_penalty': got 3 (int); accepted: a number from -2 to 2"),
])
def test_unimplemented_and_unknown_options_are_refused_naming_them(option, needle):
    with pytest.raises(OptionsError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        Options.from_dict(option)


@pytest.mark.parametrize("option", [{"mirostat": 0}, {"typical_p": 1.0}, {"tfs_z": 1}, {"num_gpu": 99},
                                    {"num_thread": 2}, {"use_mmap": False}, {"mirostat_tau": 5.0}, {"mirostat_eta": 0.1},
                                    {"pebbling_strategy": "minimal"}])
def test_neutral_values_and_placement_options_are_accepted(option):
    assert Options.from_dict(option) == Options()
