"""What runs on the build machine: pack a signed bundle, rebuild its venv offline, render the golden units."""
