"""The operator's tools: status, events and reports of a job, the timeline picture, planning."""
