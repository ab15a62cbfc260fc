"""Pre-merge checks of a team's own training configs: importers, lints and the fit verdict."""
