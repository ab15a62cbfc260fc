"""The HTML report: one static page of inline SVG plots (no script, no server, nothing fetched), built
from the baselines, the recorded memory timelines and any run files given (`oom-harness report --html`)."""
