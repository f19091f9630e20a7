"""The names people type for what they make on the box: users, projects, worker keys.

One rule for all of them, so a name that works in one place works in the others (and in a
URL, a shell and a file name without quoting).
"""

from __future__ import annotations

import re

NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
NAME_RULE = "1-64 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit"
