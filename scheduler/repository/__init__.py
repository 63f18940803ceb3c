"""Where the model repository comes from: a local directory served in place, or a remote
store (S3) copied into a local cache, listed and polled for changes."""
