"""Watching the nightly: its history in the store, unusual nights, the events automations act on."""
