"""The command line: `main` dispatches to the agent (`elastic-run ...`) or to a verb
(`notice`, `status`, `report`, `deploy`), one module each. Nothing imports `cli`;
`deploy` and `report` never load grpc or the etcd client."""
