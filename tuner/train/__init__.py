"""Training the tuner model (torch, sentencepiece and gguf are imported only in this package, by its modules; this
one stays importable without them: the CLIs check their training settings here before they import torch)."""

from edgetune.errors import BadInput

FOCUS_SHARE = 0.25  # the default share of training draws given to the focus records' cases (train.focus_repeats)


def check_focus_share(share: float, flag: str = "--focus-share") -> None:
    if not 0 <= share < 1:
        raise BadInput(f"{flag} {share:g}: must be at least 0 and below 1 (default {FOCUS_SHARE})")
