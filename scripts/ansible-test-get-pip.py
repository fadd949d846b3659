"""Stands in for the pip bootstrap script ansible-test downloads (https://ci-files.testing.ansible.com/ansible-test/
get-pip-VERSION.py), which this project's machines cannot reach: ansible-test runs it with the venv's python to put
pip into each virtual environment it makes (its sanity venvs). This one installs pip from the wheel beside it, which
scripts/setup.sh downloads from PyPI, and nothing from the network.

scripts/setup.sh copies it to .cache/ansible-test/.ansible/test/cache/get_pip_<VERSION>.py (ansible-test's cache,
under the HOME scripts/sanity.sh gives it), with pip-<VERSION>-py3-none-any.whl beside it. ansible-test passes pip
install arguments (the pinned pip, --no-setuptools, --no-wheel: the last two are get-pip's own, not pip's).
"""

import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# get_pip_24_2.py -> pip 24.2 (ansible-test names its cached copy so)
VERSION = os.path.splitext(os.path.basename(__file__))[0].replace("get_pip_", "", 1).replace("_", ".")
WHEEL = os.path.join(HERE, "pip-%s-py3-none-any.whl" % VERSION)


def main():
    if not os.path.isfile(WHEEL):
        found = sorted(glob.glob(os.path.join(HERE, "pip-*.whl")))
        sys.exit("ansible-test pip bootstrap: %s is missing (found: %s); run `make setup`" % (WHEEL, found or "none"))
    sys.path.insert(0, WHEEL)  # pip runs from its own wheel
    from pip._internal.cli.main import main as pip_main  # pylint: disable=import-outside-toplevel

    args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
    return pip_main(["install", "--no-index", "--find-links", HERE] + args)


if __name__ == "__main__":
    sys.exit(main())
