"""la-generate on a terminal escapes control characters (a sampled ESC would drive the
terminal); into a pipe or file it writes the text as drawn (issue 75)."""

import io

import numpy as np

from linear_attention.data.tokenizers import BYTES
from linear_attention.training import generate_cli


class Terminal(io.StringIO):
    def isatty(self):
        return True


class Bytes:
    name = BYTES


DRAWN = "a\x1b[2Jb\tc\rd\x7f\x9b\u00e9\n"  # ESC, tab, CR, DEL, a C1 control, é, newline


def tokens():
    return [np.asarray([b]) for b in DRAWN.encode()]


def test_a_terminal_gets_escapes():
    out = Terminal()
    generate_cli._print_tokens(tokens(), Bytes(), generate_cli._writer(out))
    assert out.getvalue() == "a\\x1b[2Jb\tc\\x0dd\\x7f\\x9b\u00e9\n\n"


def test_a_pipe_gets_the_text_as_drawn():
    out = io.StringIO()
    generate_cli._print_tokens(tokens(), Bytes(), generate_cli._writer(out))
    assert out.getvalue() == DRAWN + "\n"
