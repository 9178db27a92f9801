"""The save story: records, staging, writes, asynchronous and partial saves."""
