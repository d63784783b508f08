"""Stand-in for pypa's get-pip.py, which ansible-test downloads from a host outside the package
registries (unreachable here). Same job: put pip into ansible-test's fresh virtualenv, then
install the packages it asks for, from the package index as any pip would."""
import subprocess
import sys

subprocess.check_call([sys.executable, "-m", "ensurepip", "--upgrade", "--default-pip"])
# get-pip.py's own flags that pip itself does not take
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
subprocess.check_call([sys.executable, "-m", "pip", "install", *args])
