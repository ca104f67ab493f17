"""Producer-side tools: synthetic scenes, publishing, sinks, audits and reports."""
