"""Print the requirements of extras of pyproject.toml (comma-separated), with the base
dependencies, one a line, for `pip install -r`: an image's dependency layer is built from
pyproject.toml alone, before the source is copied, so a code change does not reinstall torch."""
import sys
import tomllib

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project.get("optional-dependencies", {})
wanted = sys.argv[2].split(",")
missing = [w for w in wanted if w not in extras]
if missing:
    sys.exit(f"pyproject.toml has no extra {missing}; extras: {', '.join(sorted(extras))}")
print("\n".join([*project.get("dependencies", []), *(r for w in wanted for r in extras[w])]))
