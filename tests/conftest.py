"""Suite-wide set-up: the signal dispositions the signal tests rely on.

A test run started in the background by a non-interactive shell (``make test &``, a CI
runner started so) inherits SIGINT ignored, and so would every subprocess a test starts;
pitstop rightly leaves an ignored signal alone, so Ctrl+C tests would fail there. Handling
SIGINT as Python does by default here also makes exec'd children start with SIGINT at its
default, as in an interactive terminal.
"""

import signal

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
