"""The user's own frames of an exception's traceback: what to show when the
user's code (a model file, a forward) fails inside autopar or torch."""
from __future__ import annotations

import os
import traceback

import torch

import autopar.passes

LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, autopar.passes.__file__, torch.__file__))
"""Frames in these folders (autopar, its passes, torch) are not the user's."""


def user_frames(exc: BaseException, folder: str | None = None) -> list:
    """The frames of ``exc``'s traceback outside autopar, torch and Python's
    own library (and, with ``folder``, inside it); the last frame if none is."""
    frames = traceback.extract_tb(exc.__traceback__)
    stdlib = os.path.dirname(os.__file__) + os.sep
    own = [f for f in frames
           if not os.path.abspath(f.filename).startswith(LIBRARY_DIRS + (stdlib,))
           and not f.filename.startswith("<")
           and (folder is None or os.path.abspath(f.filename).startswith(folder + os.sep))]
    return own or frames[-1:]


def format_frames(frames: list) -> str:
    return "".join(traceback.format_list(frames))
