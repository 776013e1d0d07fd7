"""The front doors: request router, OpenAI-style HTTP, gRPC, the Ray Serve deployment, metrics; `routing/` holds the offline routing work."""
