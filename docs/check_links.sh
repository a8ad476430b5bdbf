#!/usr/bin/env bash
# Usage: check_links.sh check_links.py FILE.md [FILE.md ...]
exec python3 "$@"
