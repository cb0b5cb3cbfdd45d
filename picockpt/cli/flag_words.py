"""A library error in the words of the command that raised it: the library names its parameters (`layers=0`,
`Config.kv_heads=8`, `schedule='interleaved'`), the user typed flags (`--layers 0`, `--kv-heads 8`,
`--schedule interleaved`). Every parameter the command has a flag for is said as that flag."""
import re

VALUE = r"""('[^']*'|"[^"]*"|[^\s,;:()\]]+)"""  # a quoted value, or a bare one up to the next separator


def flags_of(parser):
    """{parameter name: its long flag} for every option of `parser` (argparse lists them only in _actions)."""
    return {action.dest: long[0] for action in parser._actions
            for long in [[option for option in action.option_strings if option.startswith("--")]] if long}


def in_flags(message, flags):
    """`message` with each `name=value` (or `Config.name=value`) whose name has a flag written `--flag value`, and
    each such name before a bound (`tp in [1, 2]`, `virtual_stages >= 2`) or with an underscore anywhere
    (`raise max_seq`) as the flag; text already in flags (`--tp=3`) and names without a flag are left as they are
    (a bare `experts` is also a word: only its `experts=4` or `experts >= 1` is a parameter)."""
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    if not names:
        return message
    pattern = re.compile(rf"(?<![\w.\-])(?:Config\.)?({names})={VALUE}")
    message = pattern.sub(lambda m: f"{flags[m.group(1)]} {m.group(2).strip(chr(39) + chr(34))}", message)
    bound = re.compile(rf"(?<![\w.\-])(?:Config\.)?({names})(?= ?(?:>=|<=|>|<) ?\d| among | in \[)")
    message = bound.sub(lambda m: flags[m.group(1)], message)  # `layers >= 2`, `tp in [1, 2]`: the flag's name
    joined = "|".join(sorted((re.escape(name) for name in flags if "_" in name), key=len, reverse=True))
    if not joined:  # a name with an underscore is a parameter wherever it stands (`raise max_seq`)
        return message
    return re.sub(rf"(?<![\w.\-])(?:Config\.)?({joined})(?![\w\-])", lambda m: flags[m.group(1)], message)
