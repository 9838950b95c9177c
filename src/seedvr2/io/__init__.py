"""Media in and out as frame streams: videos (PyAV, audio passthrough), images, image sequences."""
