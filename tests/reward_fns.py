"""Reward functions used by the tests, imported by path inside scoring worker processes."""

import time


def length_score(prompt, response, **columns):
    return float(len(response))


def uses_columns(prompt, response, answer="", bonus=0.0, **columns):
    return (1.0 if answer in response else 0.0) + float(bonus)


def raises(prompt, response, **columns):
    raise ValueError("bad response")


def sleeps_when_asked(prompt, response, **columns):
    if "SLEEP" in response:
        time.sleep(60)
    return 1.0


def cannot_score(prompt, response, **columns):
    return None


def exits(prompt, response, **columns):
    import os

    os._exit(3)


def flaky(prompt, response, i=0, **columns):
    if i % 5 == 0:
        raise ValueError(f"sample {i} fails")
    return 1.0


def slow_or_raising(prompt, response, kind="ok", **columns):
    """For the soak: 'sleep' runs past any timeout, 'raise' raises, anything else scores 1."""
    if kind == "sleep":
        time.sleep(3600)
    if kind == "raise":
        raise RuntimeError("asked to raise")
    return 1.0


def writes_to_fd1(prompt, response, **columns):
    """Like a C library printing to fd 1 behind Python's back."""
    import os

    os.write(1, b'not json\n{"id": 999, "value": 5}\n')
    print("a print")
    return 2.0


def hangs(prompt, response, **columns):
    time.sleep(3600)


def hangs_on_marked(prompt, response, hang=False, **columns):
    if hang:
        time.sleep(3600)
    return 1.0


def returns_string(prompt, response, **columns):
    return "1.0"


def returns_bool(prompt, response, **columns):
    return True


def returns_numpy(prompt, response, **columns):
    import numpy

    return numpy.float32(0.5)


def returns_five(prompt, response, **columns):
    return 5.0


def prints_and_scores(prompt, response, **columns):
    print(f"scoring {prompt!r}")
    return 1.0, "looked fine"


def slow_length(prompt, response, **columns):
    time.sleep(0.2)
    return float(len(response))


def digit_share(prompt, response, **columns):
    """The share of digits in the response: varies between samples of a random model."""
    return sum(ch.isdigit() for ch in response) / max(len(response), 1)


def even_code_sum(prompt, response, **columns):
    """1 when the prompt's and the response's character codes sum to an even number: whatever a
    random tiny model answers, some prompts pass and others fail, and another answer to a prompt
    flips its outcome, so a pass/fail figure tells two evaluations apart."""
    return 1.0 if (sum(map(ord, prompt)) + sum(map(ord, response))) % 2 == 0 else 0.0
