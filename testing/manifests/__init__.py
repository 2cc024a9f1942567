"""The manifests under deploy/ as Kubernetes reads them: rendered (`kustomize`) and picked apart (`objects`)."""
