import signal

from .cli import exit_while_starting, leave, main

if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored (nohup, &)
    signal.signal(signal.SIGINT, exit_while_starting)  # main() makes Ctrl-C a KeyboardInterrupt before the command runs

leave(main())
