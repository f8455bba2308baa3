"""MkDocs hooks for the ra-lens site (mkdocs.yml `hooks:`)."""
