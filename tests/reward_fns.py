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
