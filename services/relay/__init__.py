"""The checkpoint relay: an HTTP server next to the trainer that publishes finished saves, and the resumable, verifying client that fetches them."""
