import signal

from .cli import exit_while_starting, main

if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored (nohup, &)
    signal.signal(signal.SIGINT, exit_while_starting)  # main() puts the default back before the command runs

raise SystemExit(main())
